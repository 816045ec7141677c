"""Shared by the pipeline tests (tests/test_pipeline.py, tests/test_pipeline_train.py): the
training flags parsed."""
from minidist.train.args import train_parser


def _parse(*flags):
    return train_parser().parse_args(list(flags))
