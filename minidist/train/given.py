"""argparse actions that note which flags were typed (`args.given`, a sorted list of dests):
--init-from and --resume take a model's or a run's value for each flag not given
(minidist/train/inputs.py, minidist/train/init_from.py).
Tests: tests/test_train.py, tests/test_keep_best.py.
"""
import argparse


class Given(argparse.Action):
    """Stores the flag's value and notes that it was given (`args.given`, a sorted list of
    names), so --init-from can tell a size the user typed from its default."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = sorted({*getattr(namespace, "given", []), self.dest})


class GivenFalse(Given):
    """`store_false`, noted as given."""

    def __init__(self, option_strings, dest, default=True, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=default, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, False, option_string)


class GivenSwitch(argparse.BooleanOptionalAction):
    """--flag / --no-flag, noted as given (a resumed run keeps its run's unless given)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.given = sorted({*getattr(namespace, "given", []), self.dest})
