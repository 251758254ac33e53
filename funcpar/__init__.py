"""funcpar: JAX-style functional tensor/data/pipeline parallel training of Hugging Face-style models on torch.func.

The public API is what this module re-exports; everything else is private. The layers and the direction of imports
are drawn in docs/ARCHITECTURE.md (and checked by tests/test_architecture.py).
"""

from . import checkpoint as checkpoint
from . import attention as attention
from . import collectives as collectives
from . import data as data
from . import decoder as decoder
from . import hf as hf
from . import layers as layers
from . import lora as lora
from . import optim as optim
from . import p2p as p2p
from . import pipeline as pipeline
from . import splitgrad as splitgrad
from . import tree as tree
from .collectives import CollectiveError as CollectiveError
from .layout import ZeroLayout as ZeroLayout
from .mesh import AbstractMesh as AbstractMesh
from .mesh import Mesh as Mesh
from .mesh import MeshError as MeshError
from .model import HFNames as HFNames
from .model import ModelError as ModelError
from .model import Loss as Loss
from .model import ModelSpec as ModelSpec
from .model import Stages as Stages
from .model import get_model as get_model
from .model import known_models as known_models
from .model import register_model as register_model
from .remat import remat as remat
from .sharding import ShardingError as ShardingError
from .sharding import gather as gather
from .sharding import shard as shard
from .spec import P as P
from .spec import SpecError as SpecError
from .spec import local_shape as local_shape
from .spec import local_slice as local_slice
from .state import MixedState as MixedState
from .state import TrainState as TrainState
from .step import Step as Step
from .step import StepError as StepError
from .step import compile_step as compile_step
from .step_config import Guards as Guards
from .step_config import Parallel as Parallel
from .step_config import Pipelining as Pipelining
from .step_config import Precision as Precision
from .step_config import StepOptions as StepOptions
from .verify import Verification as Verification
from .verify import verify as verify

__version__ = "0.1.0"
