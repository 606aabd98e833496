"""PyTorch's DDP tutorial program, as torchrun starts it on each GPU (pytorch/examples,
distributed/ddp-tutorial-series/multigpu_torchrun.py, and the tutorial "Multi GPU training
with DDP"): ``torch.cuda.set_device(LOCAL_RANK)``, ``init_process_group("nccl")``, the model
moved with an int device (``model.to(local_rank)``: an int is the current accelerator's
index to torch), ``DDP(model, device_ids=[local_rank])``, the batches moved ``.to(local_rank)``,
SGD.  Written here from the tutorial's pattern; the dataset is its datautils.MyTrainDataset.

``--accelerator``: set up as the tutorial's newer ``elastic_ddp.py`` does, through
``torch.accelerator`` (``set_device_index``, ``current_accelerator``,
``get_default_backend_for_device``, ``device_count``).  ``--cpu``: the same program on the
CPU with gloo (the comparison: the bytes of each category are the device's own)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup(args):
    if args.cpu:
        dist.init_process_group(backend="gloo")
    elif args.accelerator:
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        accelerator = torch.accelerator.current_accelerator()
        dist.init_process_group(dist.get_default_backend_for_device(accelerator))
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend="nccl")


class Trainer:
    def __init__(self, model, train_data, optimizer, device):
        self.gpu_id = device
        self.model = model.to(self.gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(self.model, device_ids=None if device == "cpu" else [self.gpu_id])

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = torch.nn.CrossEntropyLoss()(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            source = source.to(self.gpu_id)
            targets = targets.to(self.gpu_id)
            self._run_batch(source, targets)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def main():
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--total-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accelerator", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    ddp_setup(args)
    if args.cpu:
        device = "cpu"
    elif args.accelerator:
        device = dist.get_rank() % torch.accelerator.device_count()
    else:
        device = int(os.environ["LOCAL_RANK"])
    dataset = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=args.batch_size, pin_memory=not args.cpu, shuffle=False,
                        sampler=DistributedSampler(dataset))
    Trainer(model, loader, optimizer, device).train(args.total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
