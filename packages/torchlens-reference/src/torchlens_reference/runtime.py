"""The recorder hook point of the reference framework: `RECORDER` is set during a capture."""

RECORDER = None

#: Exit hooks of bound executors: each `hook(module, output) -> output`.
EXIT_HOOKS: list = []


class _Handle:
    def __init__(self, hook):
        self.hook = hook

    def remove(self) -> None:
        if self.hook in EXIT_HOOKS:
            EXIT_HOOKS.remove(self.hook)


def push_exit_hook(hook) -> _Handle:
    EXIT_HOOKS.append(hook)
    return _Handle(hook)
