"""The training worker of the context-parallel training test (importable by the gloo children)."""
import os


def train_worker(rank, world, cfg_dict):
    """``poslsh train`` on this rank as under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from poslsh_paper.experiments.lm.config import TrainConfig
    from poslsh_paper.experiments.lm.loop import train
    from poslsh_paper.experiments.serialize import config_from_dict

    return train(config_from_dict(TrainConfig, cfg_dict), progress=False)
