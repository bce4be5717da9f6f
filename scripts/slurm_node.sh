#!/usr/bin/env bash
# One machine's share of a multi-machine run: `accelerate launch` with this machine's rank, as each node of a Slurm
# job runs it (scripts/slurm_train.sbatch starts it once per node with srun). Arguments: those of
# `python -m vit_finetune`. It reads:
#   SLURM_NNODES, SLURM_NODEID     how many machines, and which one this is (0 hosts the rendezvous)
#   PROCESSES_PER_NODE             processes on this machine; default: its GPUs (SLURM_GPUS_ON_NODE)
#   MAIN_PROCESS_IP, MAIN_PROCESS_PORT   where machine 0 listens (the port defaults to 29500)
#   PRINT_ONLY=1                   print the command, one argument a line, instead of running it
set -euo pipefail
: "${SLURM_NNODES:?is not set: submit scripts/slurm_train.sbatch, or set SLURM_NNODES and SLURM_NODEID}"
: "${SLURM_NODEID:?is not set: submit scripts/slurm_train.sbatch, or set SLURM_NNODES and SLURM_NODEID}"
: "${MAIN_PROCESS_IP:?is not set: the address of machine 0 (slurm_train.sbatch sets it)}"
PROCESSES_PER_NODE=${PROCESSES_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
: "${PROCESSES_PER_NODE:?is not set and Slurm gave this node no GPU: ask for --gpus-per-node, or set it}"

# --multi_gpu picks Accelerate's torchrun launcher, which starts every process (on a machine without GPUs they
# run on the CPU). Its --cpu launcher would start ONE process whatever --num_processes says.
command=(accelerate launch --multi_gpu
         --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID"
         --num_processes "$((SLURM_NNODES * PROCESSES_PER_NODE))"
         --main_process_ip "$MAIN_PROCESS_IP" --main_process_port "${MAIN_PROCESS_PORT:-29500}"
         -m vit_finetune "$@")
if [[ "${PRINT_ONLY:-0}" == 1 ]]; then
    printf '%s\n' "${command[@]}"
else
    exec "${command[@]}"
fi
