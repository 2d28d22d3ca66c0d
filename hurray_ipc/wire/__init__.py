"""Typed wire messages: each verb a frozen dataclass, decoded and validated once at the edge."""
