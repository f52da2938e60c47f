"""How ranks find each other: the authenticated store, the handshake, the mesh."""
from .auth import new_secret
from .store import InMemoryStore, Store, StoreServer, TCPStore

__all__ = ["Store", "InMemoryStore", "TCPStore", "StoreServer", "new_secret"]
