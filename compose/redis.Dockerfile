# Stand-in for the official redis:7 image, for machines that reach no image registry (this project's
# podman machines, see compose/podman-override.yml): Debian bookworm's redis-server (7.0) on the same
# locally built base image as the conveyor image. Same conventions as the official image: config at
# /usr/local/etc/redis/redis.conf, data in /data, runs as the `redis` user.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data /usr/local/etc/redis \
 && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
