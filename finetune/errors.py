"""The one error a user sees as a line, not a traceback."""


class ConfigError(ValueError):
    """Bad recipe or argument. ``problems`` holds one ``"field: what is allowed"`` line per problem."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))
