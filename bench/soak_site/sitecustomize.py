"""Started by Python in every process of a soak's run (this folder leads its
PYTHONPATH): ``bench.fault_disk.install``, a full disk under the run's checkpoints
while the soak's trigger file exists (``bench soak --faults disk_full`` without root)."""

from bench.fault_disk import install

install()
