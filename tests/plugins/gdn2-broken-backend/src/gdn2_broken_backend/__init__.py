"""A plugin that fails on import, as one with a missing dependency does."""

import gdn2_dependency_that_does_not_exist  # noqa: F401
