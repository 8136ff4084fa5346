"""Topic-name rules of the wire contract, shared by the worker, the client and the CLI."""
from __future__ import annotations

# Topic tenancy (INFERLINE_KAFKA__TENANCY=topic): a tenant is one topic-name segment, no '.', so
# `<request topic>.<tenant>` and `<reply prefix><tenant>.` cannot be ambiguous.
TENANT_SEGMENT = r"[A-Za-z0-9_-]{1,64}"
