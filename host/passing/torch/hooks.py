"""A DDP communication hook for users whose default group stays gloo or NCCL."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist

from .backend import ProcessGroupPassing


def allreduce_hook(process_group: ProcessGroupPassing, bucket: dist.GradBucket
                   ) -> torch.futures.Future[torch.Tensor]:
    """Average each gradient bucket through PASSING.

    ``process_group`` is a group made with ``dist.new_group(backend="passing")``::

        model.register_comm_hook(dist.new_group(backend="passing"), passing.torch.allreduce_hook)
    """
    if not isinstance(process_group, ProcessGroupPassing):
        raise TypeError("allreduce_hook's state must be a PASSING group: dist.new_group(backend='passing'), "
                        f"not {type(process_group).__name__}")
    buffer = bucket.buffer()
    if process_group.stream is None or buffer.dtype != torch.float32:
        return dist.all_reduce(buffer.div_(process_group.size()), group=process_group, async_op=True).get_future() \
            .then(lambda f: f.value()[0])
    return process_group.submit(buffer, "avg").get_future().then(lambda f: f.value()[0])
