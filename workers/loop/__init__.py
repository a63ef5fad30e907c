"""One worker process of one stage: the loop over its partitions (lanes), what each entry becomes, recovery,
heartbeat. Read :mod:`workers.loop.worker` first."""
