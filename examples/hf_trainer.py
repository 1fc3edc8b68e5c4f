"""Fine-tune a causal LM with the Hugging Face Trainer and TSP under the deepspeed launcher.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed ds_configs/trainer_tsp2_cpu.json
    deepspeed --num_gpus 8 examples/hf_trainer.py --deepspeed MY_CONFIG.json --model HF_DIR
    DS_ACCELERATOR=cpu accelerate launch --config_file ds_configs/accelerate_tsp2_cpu.yaml examples/hf_trainer.py

Under ``accelerate launch`` the DeepSpeed config is the plugin's
``deepspeed_config_file`` (the accelerate config names it) and ``--deepspeed``
is left out, as in the Hugging Face docs.

The DeepSpeed config is plain JSON (the Trainer reads it) with a ``tsp``
section and ``"auto"`` batch sizes, which the Trainer fills from its
arguments; ``ds_configs/trainer_tsp2_cpu.json`` is TSP=2 with ZeRO-1,
``trainer_tsp2_zero3_cpu.json`` and ``trainer_tsp2_zero2_offload_cpu.json`` are
the Hugging Face docs' ZeRO-3 and ZeRO-2 (optimizer offload) configs. Against
a stock Trainer script, two lines change: ``ds_tsp.TSPTrainer`` in place of
``transformers.Trainer``, and the ``tsp`` section in the config. Without
``--model`` it fine-tunes the small byte-level Llama of ``examples/train.py``
on text that ships with Python, so it needs no download. ``--lora 8`` trains
LoRA adapters of rank 8 (a PEFT model, as for any Trainer) and writes PEFT's
adapter directory. On CPU ranks
(``DS_ACCELERATOR=cpu``) accelerate needs its state configured for DeepSpeed
over gloo first (``ds_tsp.configure_cpu_ranks``). Prints the Trainer's
logs as JSON lines, then the loss of the first and last 5 steps, the eval loss
and where the Hugging Face model was written.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

import ds_tsp
from train import byte_corpus, small_byte_llama


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed", help="DeepSpeed JSON config with a tsp section (under accelerate launch: "
                        "the DeepSpeed plugin's deepspeed_config_file instead)")
    parser.add_argument("--model", help="Hugging Face model directory (default: a small byte-level Llama)")
    parser.add_argument("--output-dir", default="hf_trainer_out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="per data-parallel replica")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-steps", type=int, default=0,
                        help="write a Trainer checkpoint (Hugging Face model + DeepSpeed checkpoint) every N steps")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="fine-tune LoRA adapters of this rank on every projection (PEFT), the base frozen")
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def windows(corpus, count, seq_len, seed):
    """``count`` random windows of the corpus as Trainer examples (labels = inputs)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(corpus) - seq_len, (count,), generator=generator).tolist()
    return [{"input_ids": corpus[s:s + seq_len], "labels": corpus[s:s + seq_len]} for s in starts]


class JsonLogs(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            print(json.dumps({"step": state.global_step, **logs}), flush=True)


def training_arguments(args, configured_state):
    """The Trainer's arguments; ``configured_state``: use the accelerate state
    ``ds_tsp.configure_cpu_ranks`` set up (DeepSpeed on CPU ranks)."""
    return TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps, learning_rate=args.lr, weight_decay=0.01, warmup_steps=5,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, report_to=[], include_num_input_tokens_seen="all", disable_tqdm=True,
        accelerator_config={"use_configured_state": configured_state})


def datasets(seq_len):
    """``(train, eval)`` windows of the corpus that ships with Python."""
    corpus = byte_corpus()
    return windows(corpus, 4096, seq_len, seed=0), windows(corpus, 16, seq_len, seed=1)


def main():
    args = parse_args()
    on_cpu = os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
    if on_cpu:
        ds_tsp.configure_cpu_ranks()
    training_args = training_arguments(args, configured_state=on_cpu)
    torch.manual_seed(training_args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model) if args.model else small_byte_llama()
    if args.lora:  # PEFT's own model: TSP shards each adapter with its base weight
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    train, evaluation = datasets(args.seq_len)
    trainer = ds_tsp.TSPTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                                callbacks=[JsonLogs()])
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    final_dir = os.path.join(args.output_dir, "final")
    # An ordinary Hugging Face directory gathered from the TSP shards; with --lora PEFT's adapter directory.
    trainer.save_model(final_dir)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if dist.get_rank() == 0:
        print(f"ds_tsp: {trainer.tsp_topology} | loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps, "
              f"eval loss {eval_loss:.3f}, model written to {final_dir}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
