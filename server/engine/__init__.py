"""The serving engine: scheduler and block manager (pure Python), model runner, sampler."""
