"""The one exception the rewrite raises for a model it refuses; its message says why."""


class RewriteError(ValueError):
    pass
