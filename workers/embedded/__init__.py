"""The private redis-server of ``conveyor run`` and the tests: finding a binary, its directory, its life."""
