"""How ranks find each other: the authenticated store, the handshake, the mesh."""
from .auth import new_secret
from .store import InMemoryStore, PrefixStore, Store, StoreServer, TCPStore

__all__ = ["Store", "InMemoryStore", "PrefixStore", "TCPStore", "StoreServer", "new_secret"]
