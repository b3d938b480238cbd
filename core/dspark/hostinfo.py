"""Plugin API 1.3 name of :mod:`dspark.host.hostinfo`, kept so plugins written against 1.3 load unchanged.

New code imports :mod:`dspark.host.hostinfo` (see docs/plugins.md); this module *is* that module.
"""

import sys

import dspark.host.hostinfo as _target

sys.modules[__name__] = _target
