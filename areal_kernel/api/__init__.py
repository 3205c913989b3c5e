"""Public data structures and protocols of the kernel (no torch at import time).

``io``: requests, responses and trajectories. One module per registry kind
holds that kind's contract and the frozen context its factory receives
(``kinds`` lists them; ``Registry.build(kind, name, ctx)`` builds through
them): ``train_engine`` (``engine``), ``inference_engine``,
``weight_transport``, ``scheduler``, ``platform``, ``dataset``, ``reward``,
``workflow``, ``advantage_estimator``, ``loss``, ``metric_sink``,
``model_source``, ``trainer``, ``tool_parser`` and ``tool``.
"""
