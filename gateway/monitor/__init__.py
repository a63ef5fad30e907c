"""What a gateway tells operators: the pipeline's status read from Redis, and Prometheus metrics."""
