"""The only code that talks to hivemind: DHT records, signing, membership, profiling, links, transport."""
