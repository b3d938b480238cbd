"""Plugin API 1.3 name of :mod:`dspark.host.log`, deprecated: importing it warns (``DeprecationWarning``,
removed in plugin API 2.0), and every attribute read or set here is that module's.

New code uses what :mod:`dspark.sdk` offers (see docs/plugins.md).
"""

import dspark.host.log as _target
from dspark.host.aliases import deprecated_alias

deprecated_alias(__name__, _target, "dspark.sdk.get_logger")
