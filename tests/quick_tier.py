"""The quick tier: what ``make test`` runs (``pytest --tier quick``).

Every public entry point and every block kind, at TSP 2 against the unsharded
Hugging Face model or one process, each beside the guard that shows its check
fails on a wrong shard, plus the refusals and the planner, which cost little.
CI runs the whole suite (``make test-all``): sizes 1 and 4, every family,
every ZeRO stage and layout, the benchmarks' smoke runs and the examples under
the deepspeed launcher and accelerate (``make demo`` runs the launcher too). An entry is a test file, a test function (all its cases) or one
case; an entry that matches no collected test stops the run, so a renamed
test cannot drop out of the tier unseen.
"""

QUICK_TIER = [
    # Configuration, refusals, topology, the communication counter, the planner and its CLI, the docs, the package.
    "test_config.py", "test_topology.py", "test_comm.py", "test_inputs.py", "test_consistency.py",
    "test_layout.py", "test_plan_cli.py", "test_plan_shapes.py", "test_plan_strategies.py", "test_plan_time.py",
    "test_plan_longest.py", "test_docs.py", "test_package.py", "test_host_syncs.py",
    # NCCL's rules, enforced on CPU by the meta-device dry run (seconds: nothing is computed).
    "test_nccl_rules.py", "test_gpu_check.py",
    # Blocks at TSP 2 against Hugging Face's modules in float64, each with its wrong-shard guard.
    "test_attention.py::test_matches_hugging_face_attention[zigzag-True-2]",
    "test_attention.py::test_a_wrong_shard_is_caught",
    "test_attention.py::test_bytes_equal_the_design_formula",
    "test_mlp.py::test_matches_hf_mlp[2-silu]",
    "test_mlp.py::test_check_catches_a_wrong_shard",
    "test_mlp.py::test_ring_bytes",
    "test_vocab.py::test_whole_model_with_folded_vocabulary_matches_hugging_face[2]",
    "test_vocab.py::test_a_wrong_vocabulary_shard_is_caught_in_the_model",
    "test_sparse_attention.py::test_sparse_attention_matches_hugging_face[2]",
    "test_sparse_attention.py::test_a_wrong_choice_is_caught",
    "test_moe.py::test_loss_aux_loss_and_every_gradient_match_hugging_face[2]",
    "test_moe.py::test_a_wrong_expert_shard_router_bias_sink_or_return_permutation_is_caught",
    "test_latent.py::test_latent_attention_matches_hugging_face[2]",
    "test_latent.py::test_a_wrong_latent_or_shard_is_caught",
    "test_linear_attention.py::test_hybrids_match_hugging_face[2]",
    "test_linear_attention.py::test_a_wrong_map_halo_or_shard_is_caught",
    "test_mamba2.py::test_mamba2_hybrids_match_hugging_face[2]",
    "test_mamba2.py::test_a_wrong_map_halo_or_shard_is_caught",
    "test_mamba1.py::test_jamba_matches_hugging_face[2]",
    "test_mamba1.py::test_a_wrong_map_halo_or_shard_is_caught",
    "test_short_conv.py::test_lfm_hybrids_match_hugging_face[2]",
    "test_short_conv.py::test_a_dropped_halo_or_wrong_shard_is_caught",
    "test_documents.py::test_packed_documents_match_hugging_face[2]",
    "test_documents.py::test_unpacked_attention_would_be_caught",
    "test_expert_parallel.py::test_folded_experts_match_one_process_over_the_global_batch",
    "test_expert_parallel.py::test_a_wrong_expert_owner_is_caught",
    # ds_tsp.inject on whole models, and the probe of a class the tables do not name.
    "test_model.py::test_loss_and_every_gradient_match_hugging_face[2]",
    "test_model.py::test_a_wrong_shard_is_caught",
    "test_policy.py::test_classes_probed_under_eager_and_sdpa_are_exact[2]",
    # The model's own rotary function (interleaved pairs), NoPE layers and position-scaled queries; Cohere's
    # parallel block and scaled logits; ungated MLPs.
    "test_model.py::test_rotary_conventions_match_hugging_face[2]",
    "test_model.py::test_a_wrong_rotary_convention_is_caught",
    "test_model.py::test_cohere_families_match_hugging_face[2]",
    "test_model.py::test_a_wrong_cohere_block_is_caught",
    "test_model.py::test_ungated_mlps_match_hugging_face[2]",
    "test_model.py::test_a_wrong_ungated_mlp_shard_is_caught",
    # Llama 4: chunked and NoPE layers, temperature tuning, input-scaled experts.
    "test_model.py::test_llama4_matches_hugging_face[2]",
    "test_model.py::test_a_wrong_llama4_piece_is_caught",
    # Gemma 4: full layers of their own head sizes, keys as values, experts beside the MLP, shared keys and
    # values, per-layer inputs.
    "test_model.py::test_gemma4_experts_beside_the_mlp_match_hugging_face[2]",
    "test_model.py::test_gemma4_per_layer_inputs_match_hugging_face[2]",
    "test_model.py::test_a_wrong_gemma4_piece_is_caught",
    # Vision-language models: the tower's share per rank, visual rows to their tokens' ranks, M-RoPE positions,
    # Gemma 3's images attended both ways.
    "test_vision_language.py::test_vision_language_models_match_hugging_face[qwen2_vl-2]",
    "test_vision_language.py::test_a_wrong_visual_row_position_or_dropped_deepstack_is_caught[route-qwen2_vl]",
    "test_vision_language.py::test_vision_language_models_match_hugging_face[gemma3-2]",
    "test_documents.py::test_bidirectional_spans_give_hugging_faces_blockwise_mask[2-5]",
    # ds_tsp.initialize under DeepSpeed: ZeRO-1 over TSP 2 x DP 2, ZeRO-3, bf16, resume, a dead rank, export.
    "test_engine.py::test_training_matches_a_single_process_run[4-2-1-sgd-False-False-llama-False]",
    "test_engine.py::test_training_matches_a_single_process_run[2-2-3-sgd-False-False-llama-False]",
    "test_engine.py::test_the_comparison_catches_a_wrong_shard",
    "test_engine.py::test_what_tsp_cannot_combine_with_is_refused",
    "test_engine.py::test_bf16_training_follows_fp32",
    "test_engine.py::test_resume_from_a_checkpoint_reproduces_the_losses",
    "test_engine.py::test_a_dead_rank_fails_its_peer_instead_of_hanging",
    "test_engine.py::test_export_turns_a_deepspeed_checkpoint_into_hugging_face[llama-tsp_options0]",
    "test_pipeline.py::test_pipeline_matches_a_single_process_run[2-False-llama-16-None]",
    "test_pipeline.py::test_the_comparison_catches_a_wrong_shard",
    # Checkpoints: from_pretrained / save_pretrained by slices, ds-tsp convert, reshard, saves that fail.
    "test_checkpoint.py::test_from_pretrained_then_save_pretrained_is_bit_exact[llama-2]",
    "test_checkpoint.py::test_from_pretrained_gives_the_loss_of_in_memory_inject[2]",
    "test_checkpoint.py::test_a_misplaced_or_wrong_shard_is_caught",
    "test_checkpoint.py::test_every_rank_raises_the_refusal",
    "test_checkpoint.py::test_convert_then_join_is_bit_exact[llama-2]",
    "test_reshard.py::test_a_checkpoint_resumes_on_another_layout[tsp2xdp2-to-tsp4]",
    "test_reshard.py::test_moments_of_the_wrong_shard_are_caught",
    "test_failed_saves.py",
    # Hugging Face's generate on the injected model.
    "test_generate.py::test_decoding_strategies_give_hugging_face_tokens[2]",
    "test_generate.py::test_a_wrong_shard_is_caught",
    # The Trainer, TRL (SFT, DPO, GRPO) and PEFT LoRA.
    "test_trainer.py::test_trainer_matches_one_process[2-2]",
    "test_trainer.py::test_trl_sft_trainer_matches_one_process[False]",
    "test_preference.py::test_dpo_trainer_matches_one_process[llama-2-sigmoid-adamw_torch]",
    "test_preference.py::test_dpo_with_lora_matches_one_process",
    "test_grpo.py::test_grpo_trainer_matches_trl[2-grpo]",
    "test_lora.py::test_loss_and_every_adapter_gradient_match_the_peft_model[2]",
    "test_lora.py::test_the_inner_model_and_a_wrong_adapter_shard",
]
