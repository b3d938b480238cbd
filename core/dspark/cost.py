"""Plugin API 1.3 name of :mod:`dspark.sdk.cost`, kept so plugins written against 1.3 load unchanged.

New code imports :mod:`dspark.sdk.cost` (see docs/plugins.md); this module *is* that module.
"""

import sys

import dspark.sdk.cost as _target

sys.modules[__name__] = _target
