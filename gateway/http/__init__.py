"""The HTTP/1.1 front of a gateway: parsing, routing, framing, connections, the server (no framework)."""
