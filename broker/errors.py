"""The errors of the Redis client, under conveyor's names: ``workers/`` and ``gateway/`` catch these
and never import redis-py (the one package that speaks to Redis is ``broker/``)."""

from __future__ import annotations

import redis
import redis.asyncio
import redis.client

from broker.connection import CONNECTION_ERRORS, CONNECTION_OR_REPLY_ERRORS, is_refusal, is_transient

__all__ = [
    "CONNECTION_ERRORS",
    "CONNECTION_OR_REPLY_ERRORS",
    "AsyncClient",
    "AuthenticationError",
    "BusyLoadingError",
    "NoScriptError",
    "RedisError",
    "ReplyError",
    "SyncClient",
    "SyncPipeline",
    "is_refusal",
    "is_transient",
]

RedisError = redis.RedisError  # every error of the client
ReplyError = redis.ResponseError  # an error reply: the command reached Redis, which refused it
NoScriptError = redis.exceptions.NoScriptError
AuthenticationError = redis.AuthenticationError
BusyLoadingError = redis.BusyLoadingError
# The clients, as opaque handles: made by broker.connection.RedisSettings, used by broker's operations.
SyncClient = redis.Redis
AsyncClient = redis.asyncio.Redis
SyncPipeline = redis.client.Pipeline
