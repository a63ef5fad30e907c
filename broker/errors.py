"""The errors of the Redis client, under conveyor's names: ``workers/`` and ``gateway/`` catch these
and never import redis-py (the one package that speaks to Redis is ``broker/``)."""

from __future__ import annotations

import redis

from broker.connection import CONNECTION_ERRORS, CONNECTION_OR_REPLY_ERRORS, error_text, is_refusal, is_transient

__all__ = [
    "CONNECTION_ERRORS",
    "CONNECTION_OR_REPLY_ERRORS",
    "RedisError",
    "ReplyError",
    "SyncClient",
    "error_text",
    "is_refusal",
    "is_transient",
]

RedisError = redis.RedisError  # every error of the client
ReplyError = redis.ResponseError  # an error reply: the command reached Redis, which refused it
# A client, as an opaque handle: made by broker.connection.RedisSettings, used by broker's operations.
SyncClient = redis.Redis
