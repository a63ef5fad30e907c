"""What speaks Redis: key names, the codec, the stream protocol, the Lua scripts with their Python
owners (``Submitter`` for gateways, ``Committer`` for workers), the spec record, connections."""
