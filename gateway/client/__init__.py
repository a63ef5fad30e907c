"""The Python API of the gateway: submit requests to a pipeline, await their answers."""
