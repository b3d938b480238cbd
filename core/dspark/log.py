"""Plugin API 1.3 name of :mod:`dspark.host.log`, kept so plugins written against 1.3 load unchanged.

New code imports :mod:`dspark.host.log` (see docs/plugins.md); this module *is* that module.
"""

import sys

import dspark.host.log as _target

sys.modules[__name__] = _target
