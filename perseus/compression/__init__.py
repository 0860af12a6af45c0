"""Lossy gradient compression that runs its own collectives, framework-neutral (NumPy).

The framework modules expose these through their ``Compression`` namespaces
(``hvd.Compression.topk(0.01)``); see docs/compression.md.
"""

from perseus.compression.base import Pending, Reducer
from perseus.compression.cupcake import Cupcake
from perseus.compression.espresso import Espresso
from perseus.compression.hierarchical import HiTopK
from perseus.compression.powersgd import PowerSGD
from perseus.compression.qsgd import QSGD
from perseus.compression.randomk import RandomK
from perseus.compression.sign import Sign
from perseus.compression.topk import TopK

__all__ = ["Reducer", "Pending", "TopK", "HiTopK", "RandomK", "Sign", "QSGD", "PowerSGD", "Cupcake", "Espresso",
           "REDUCERS"]

#: name -> class, for the Compression namespaces and the command line
REDUCERS = {"topk": TopK, "hitopk": HiTopK, "randomk": RandomK, "sign": Sign, "qsgd": QSGD,
            "powersgd": PowerSGD, "cupcake": Cupcake, "espresso": Espresso}
