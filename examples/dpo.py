"""Preference-tune a chat model with TRL's DPOTrainer and TSP under the deepspeed launcher.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/dpo.py --deepspeed ds_configs/trainer_tsp2_cpu.json
    deepspeed --num_gpus 8 examples/dpo.py --deepspeed MY_CONFIG.json --model HF_DIR

``ds_tsp.TSPDPOTrainer`` is TRL's ``DPOTrainer`` with TSP from the DeepSpeed
config's ``tsp`` section: the chosen and rejected completions' log-probabilities
come from the folded LM head (no full logits), and the reference model is
TSP-sharded as the policy is. Without ``--model`` it tunes the small byte-level
Llama of ``train.py`` on pairs built in code (a sum's right answer against a
wrong one), so it needs no download. Prints the Trainer's logs as JSON lines,
then the first and last loss and reward margin.
"""

import argparse
import copy
import os

import torch
import torch.distributed as dist
from trl import DPOConfig

import ds_tsp
from chat import byte_chat_tokenizer, small_chat_llama
from hf_trainer import JsonLogs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed JSON config with a tsp section")
    parser.add_argument("--model", help="Hugging Face model directory with its tokenizer (default: a small "
                        "byte-level Llama)")
    parser.add_argument("--output-dir", default="dpo_out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=2, help="pairs per data-parallel replica")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss-type", default="sigmoid", help="TRL's DPO loss (sigmoid, ipo, ...)")
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def sum_pairs():
    """Conversational preference pairs: "add a and b" answered right (chosen) and off by one (rejected)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"add {a} and {b}"}],
                               "chosen": [{"role": "assistant", "content": str(a + b)}],
                               "rejected": [{"role": "assistant", "content": str(a + b + 1)}]}
                              for a in range(20) for b in range(20)])


def main():
    args = parse_args()
    on_cpu = os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
    if on_cpu:
        ds_tsp.configure_cpu_ranks()
    config = DPOConfig(output_dir=args.output_dir, deepspeed=args.deepspeed,
                       per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulation,
                       max_steps=args.steps, learning_rate=args.lr, beta=args.beta, loss_type=[args.loss_type],
                       logging_steps=args.logging_steps, save_strategy="no", report_to=[], disable_tqdm=True,
                       bf16=False, accelerator_config={"use_configured_state": on_cpu})
    if args.model:  # TRL loads the policy and, from the same directory, the reference model
        model, ref_model, tokenizer = args.model, None, None
    else:
        torch.manual_seed(config.seed)
        tokenizer = byte_chat_tokenizer()
        model = small_chat_llama(tokenizer)
        ref_model = copy.deepcopy(model)
    trainer = ds_tsp.TSPDPOTrainer(model=model, ref_model=ref_model, args=config, train_dataset=sum_pairs(),
                                   processing_class=tokenizer, callbacks=[JsonLogs()])
    trainer.train()
    final_dir = os.path.join(args.output_dir, "final")
    trainer.save_model(final_dir)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    if dist.get_rank() == 0:
        print(f"ds_tsp: {trainer.tsp_topology} | DPO loss {logs[0]['loss']:.3f} -> {logs[-1]['loss']:.3f}, reward "
              f"margin {logs[0]['rewards/margins']:.3f} -> {logs[-1]['rewards/margins']:.3f} over {args.steps} "
              f"steps, model written to {final_dir}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
