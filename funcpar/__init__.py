"""funcpar: JAX-style functional tensor/data/pipeline parallel training of Hugging Face-style models on torch.func.

The public API is what this module re-exports; everything else is private. The packages by concern and the direction
of imports between them are drawn in docs/ARCHITECTURE.md (and checked by tests/test_architecture.py).
"""

from funcpar.io import checkpoint as checkpoint
from funcpar.nn import attention as attention
from funcpar.parallel import collectives as collectives
from funcpar import data as data
from funcpar.nn import decoder as decoder
from funcpar.io import hf as hf
from funcpar.nn import layers as layers
from funcpar.train import lora as lora
from funcpar import optim as optim
from funcpar.parallel import p2p as p2p
from funcpar import pipeline as pipeline
from funcpar.pipeline import splitgrad as splitgrad
from funcpar import tree as tree
from funcpar.parallel.collectives import CollectiveError as CollectiveError
from funcpar.parallel.layout import ZeroLayout as ZeroLayout
from funcpar.parallel.mesh import AbstractMesh as AbstractMesh
from funcpar.parallel.mesh import Mesh as Mesh
from funcpar.parallel.mesh import MeshBase as MeshBase
from funcpar.parallel.mesh import MeshError as MeshError
from funcpar.parallel.mesh import init_distributed as init_distributed
from funcpar.model import DECODER_CONFIG_TYPES as DECODER_CONFIG_TYPES
from funcpar.model import HFNames as HFNames
from funcpar.model import ModelError as ModelError
from funcpar.model import Loss as Loss
from funcpar.model import ModelSpec as ModelSpec
from funcpar.model import Stages as Stages
from funcpar.model import get_model as get_model
from funcpar.model import known_models as known_models
from funcpar.model import register_model as register_model
from funcpar.nn.remat import remat as remat
from funcpar.parallel.sharding import ShardingError as ShardingError
from funcpar.parallel.sharding import gather as gather
from funcpar.parallel.sharding import shard as shard
from funcpar.spec import P as P
from funcpar.spec import SpecError as SpecError
from funcpar.spec import local_shape as local_shape
from funcpar.spec import local_slice as local_slice
from funcpar.state import Handoff as Handoff
from funcpar.state import MixedState as MixedState
from funcpar.state import TrainState as TrainState
from funcpar.train.step import Step as Step
from funcpar.train.step import StepError as StepError
from funcpar.train.step import compile_step as compile_step
from funcpar.train.config import Guards as Guards
from funcpar.train.config import Parallel as Parallel
from funcpar.train.config import Pipelining as Pipelining
from funcpar.train.config import Precision as Precision
from funcpar.train.config import StepOptions as StepOptions
from funcpar.train.verify import Verification as Verification
from funcpar.train.verify import verify as verify

__version__ = "0.1.0"
