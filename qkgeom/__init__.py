"""qkgeom: measure and causally steer the geometry of queries and keys in Transformer attention."""

__version__ = "0.1.0"
