"""Pipeline stages: schedules and stage cuts as data, the executor that walks a schedule, the split backward.

The schedules' names are re-exported here (``fp.pipeline.make_schedule``)."""

from funcpar.pipeline.schedule import PipelineError as PipelineError
from funcpar.pipeline.schedule import Action as Action
from funcpar.pipeline.schedule import Schedule as Schedule
from funcpar.pipeline.schedule import assign_layers as assign_layers
from funcpar.pipeline.schedule import assign_units as assign_units
from funcpar.pipeline.schedule import gpipe as gpipe
from funcpar.pipeline.schedule import one_f_one_b as one_f_one_b
from funcpar.pipeline.schedule import interleaved_1f1b as interleaved_1f1b
from funcpar.pipeline.schedule import zero_bubble as zero_bubble
from funcpar.pipeline.schedule import make_schedule as make_schedule
from funcpar.pipeline.schedule import SCHEDULES as SCHEDULES

__all__ = ['PipelineError', 'Action', 'Schedule', 'assign_layers', 'assign_units', 'gpipe', 'one_f_one_b',
           'interleaved_1f1b', 'zero_bubble', 'make_schedule', 'SCHEDULES']
