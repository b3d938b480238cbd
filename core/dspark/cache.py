"""Plugin API 1.3 name of :mod:`dspark.host.cache`, kept so plugins written against 1.3 load unchanged.

New code imports :mod:`dspark.host.cache` (see docs/plugins.md); this module *is* that module.
"""

import sys

import dspark.host.cache as _target

sys.modules[__name__] = _target
