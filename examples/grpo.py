"""Train a chat model with reinforcement learning (TRL's GRPOTrainer) and TSP under the deepspeed launcher.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/grpo.py --deepspeed ds_configs/trainer_tsp2_cpu.json
    deepspeed --num_gpus 8 examples/grpo.py --deepspeed MY_CONFIG.json --model HF_DIR

``ds_tsp.TSPGRPOTrainer`` is TRL's ``GRPOTrainer`` with TSP from the DeepSpeed
config's ``tsp`` section: completions are sampled by Hugging Face's ``generate``
on the TSP model (a sequence-sharded KV cache; every rank of a TSP group draws
the same tokens), their log-probabilities under the policy and the TSP-sharded
reference model come from the folded LM head, and TRL's loss (``--loss-type``
grpo, dr_grpo, dapo, bnpo) is normalized over data-parallel replicas as one
process would. Without ``--model`` it trains the small byte-level Llama of
``train.py`` to answer "add a and b" prompts with digits (the reward: the share
of a completion's characters that are digits), so it needs no download.
Prints the Trainer's logs as JSON lines, then the first and last mean reward.
"""

import argparse
import os

import torch
import torch.distributed as dist
from trl import GRPOConfig

import ds_tsp
from chat import byte_chat_tokenizer, small_chat_llama
from hf_trainer import JsonLogs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed JSON config with a tsp section")
    parser.add_argument("--model", help="Hugging Face model directory with its tokenizer (default: a small "
                        "byte-level Llama)")
    parser.add_argument("--output-dir", default="grpo_out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4, help="completions per data-parallel replica")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--beta", type=float, default=0.04, help="weight of the KL to the reference model")
    parser.add_argument("--loss-type", default="dapo", help="TRL's GRPO loss (grpo, dr_grpo, dapo, bnpo, ...)")
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def sum_prompts():
    """Conversational prompts "add a and b"."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"add {a} and {b}"}]}
                              for a in range(20) for b in range(20)])


def digit_share(completions, **kwargs):
    """The reward: the share of each completion's characters that are digits."""
    texts = [completion[-1]["content"] for completion in completions]
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in texts]


def main():
    args = parse_args()
    on_cpu = os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
    if on_cpu:
        ds_tsp.configure_cpu_ranks()
    config = GRPOConfig(output_dir=args.output_dir, deepspeed=args.deepspeed,
                        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulation,
                        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                        max_steps=args.steps, learning_rate=args.lr, beta=args.beta, loss_type=args.loss_type,
                        logging_steps=args.logging_steps, save_strategy="no", report_to=[], disable_tqdm=True,
                        bf16=False, accelerator_config={"use_configured_state": on_cpu})
    tokenizer = None
    if args.model:  # TRL loads the policy and, from the same directory, the reference model
        model = args.model
    else:  # saved first: TRL loads the reference model from the policy's directory
        torch.manual_seed(config.seed)
        tokenizer = byte_chat_tokenizer()
        model = os.path.join(args.output_dir, "initial")
        if dist.get_rank() == 0:
            small_chat_llama(tokenizer).save_pretrained(model)
        dist.barrier()
    trainer = ds_tsp.TSPGRPOTrainer(model=model, reward_funcs=digit_share, args=config, train_dataset=sum_prompts(),
                                    processing_class=tokenizer, callbacks=[JsonLogs()])
    trainer.train()
    final_dir = os.path.join(args.output_dir, "final")
    trainer.save_model(final_dir)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    if dist.get_rank() == 0:
        print(f"ds_tsp: {trainer.tsp_topology} | mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f} over "
              f"{args.steps} steps, model written to {final_dir}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
