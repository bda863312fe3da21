"""kvtop: is KV-cache preemption hurting your inter-token latency, and what should you change?"""

__version__ = "0.1.0"
