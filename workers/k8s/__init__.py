"""Kubernetes manifests for a pipeline (``conveyor k8s APP``): a Deployment per stage, the gateway's
Deployment and Service, and KEDA ScaledObjects that scale each stage on its own stream.

It lives in ``workers`` because it needs the pipeline's stages (their ``workers``, ``batch_size``,
``stuck_grace_s``...), which only the worker side may import; the gateway never imports stage code.
Nothing here talks to Kubernetes: the command prints manifests for ``kubectl apply -f -``
(docs/deployment.md, "Kubernetes with KEDA").
"""
