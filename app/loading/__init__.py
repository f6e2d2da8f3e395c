"""Turn a verified artifact into a servable model, or reject it with a category.

    compatibility -> memory budget -> build from service code (meta device) -> what the
    weights file declares (stored zip records / safetensors header: keys, shapes, dtypes,
    sizes) checked before any tensor is read -> strict load of the verified bytes ->
    placement -> eval -> dry run on service-owned requests -> output validation -> CUDA
    synchronize

The model is service code: the family registered for the manifest's architecture
(``app.model_family``) builds it, preprocesses requests, runs its forward and supplies its dry
run; nothing here knows one family from another.

Rejections (ArtifactRejected): ``runtime`` (runtime, precision, architecture or torch version
not supported), ``schema`` (feature schema, the family's preprocessing files, label files),
``load`` (bytes that do not deserialize, missing/unexpected keys, shapes, dtypes), ``dry_run``
(failed or invalid output on representative requests, the family's invariants), ``budget``
(would not fit next to the resident model), and ``size``/``digest`` from re-checking the
bytes read.

The package, by what each module decides:

- ``control``: how a background load runs (counted, cancellable, paced, lowered priority);
- ``device``: the device, the runtime build, the compute dtype;
- ``formats``: the weights files, checked before a tensor is read;
- ``model``: the loaded model and its dry run;
- ``backbones``: backbones resident for the heads that pin them;
- ``candidate``: the candidate load, step by step (``load_verified``, ``load_backbone``);
- ``memory``: the memory budget a candidate must fit beside the model serving;
- ``failures``: what a failed load reports, and whether another attempt can cure it;
- ``pipeline``: a replica's target fetched through the cache, loaded and installed as a
  generation (``ModelLoader``).

Importing the package imports none of them: ``control`` is used where torch is not (the
cache, the CLI's commands that read only manifests).
"""
