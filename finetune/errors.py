"""The errors a user sees as a line, not a traceback."""


class ConfigError(ValueError):
    """Bad recipe or argument. ``problems`` holds one ``"field: what is allowed"`` line per problem."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class WriteError(OSError):
    """An output the run could not write (a full disk). ``problems`` holds the line saying what and where; the run
    stops (exit code 1) and its previous checkpoint stays the latest."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))
