"""Former home of the host parameter store, now `lazytrain.models.host_params`.

Kept only because `runtime/profiler.py` still imports `HostParams` and `ParamGroup` from here;
once that import names `lazytrain.models.host_params`, delete this file. Nothing else imports
it (`tools/package_graph.py` shows the remaining runtime -> models edge it adds).
"""

from lazytrain.models.host_params import HostParams, ParamGroup

__all__ = ["HostParams", "ParamGroup"]
