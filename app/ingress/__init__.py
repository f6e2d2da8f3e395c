"""The ingress core: everything the router decides, without Ray, Starlette or torch.

The router deployment (``deployments/router.py``) is a thin Serve shell around
``app.ingress.core.IngressCore``: it owns the deployment handles and hands the core async send
callables built on them, the way Ray Serve keeps its request-router policy apart from the
replica transport. What the core decides (the cohort, the failover order, the breakers, the
hot standby, the mirrored copies) is unit-tested here with fake senders and a fake clock.
"""
