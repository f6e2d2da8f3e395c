"""The model families this service ships (``app.model_family`` is the interface they
implement): ``ranker_mlp`` (the default) and ``two_tower``."""
