"""Plugin API 1.3 name of :mod:`dspark.sdk.quant`, deprecated: importing it warns (``DeprecationWarning``,
removed in plugin API 2.0), and every attribute read or set here is that module's.

New code imports :mod:`dspark.sdk.quant` (see docs/plugins.md).
"""

import dspark.sdk.quant as _target
from dspark.host.aliases import deprecated_alias

deprecated_alias(__name__, _target)
