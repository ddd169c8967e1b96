"""Unique keys: a task's arguments bound, selected or hashed into the key a store holds.

Arguments and payload paths, the canonical form that hashing reads, request
fingerprints, and the layout of storage keys. Nothing here talks to a store or
a broker.
"""
