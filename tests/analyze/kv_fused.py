"""fusedqkv_postnorm with its fused Wqkv taken apart in four blocks (CodeGen's layout), or into a q projection of its own and one
Linear holding k and v (TeleChat's query + key_value), in either row layout; shared by the
convert and e2e tests."""

QKV_INIT = "        self.Wqkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)\n"
Q_KV_INIT = """        self.wq = nn.Linear(config.hidden_size, self.q_size, bias=True)
        self.wkv = nn.Linear(config.hidden_size, 2 * self.kv_size, bias=True)
"""
QKV_FORWARD = """        q, k, v = self.Wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
"""
# the rows of wkv: k and v side by side per kv head ([h0: k v][h1: ...]), as TeleChat's
PER_HEAD = """        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        kv = self.wkv(x).view(b, t, self.n_kv_heads, 2 * self.head_dim)
        k, v = kv.split(self.head_dim, dim=-1)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
"""
# ... all of k, then all of v
BLOCKS = """        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).chunk(2, dim=-1)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
"""
LAYOUTS = {"per_head": PER_HEAD, "blocks": BLOCKS}


def q_beside_kv(source: str, layout: str) -> str:
    """modeling_fusedqkv_postnorm.py's text with q apart and k/v fused in ``layout``."""
    assert source.count(QKV_INIT) == 1 and source.count(QKV_FORWARD) == 1
    return source.replace(QKV_INIT, Q_KV_INIT).replace(QKV_FORWARD, LAYOUTS[layout])


# Wqkv as four blocks, each of a quarter of the heads (CodeGen's mp_num), in ``order``;
# one kv head per head. With four heads, one block per head: "q, k, v" is then the per-head
# layout too, and only a second head count tells them apart.
MP_BLOCKS = """        blocks = self.Wqkv(x).reshape(b, t, 4, -1)
        {order} = blocks.split(self.q_size // 4, dim=-1)
        q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
"""


def mp_blocks(source: str, order: str) -> str:
    """modeling_fusedqkv_postnorm.py's text with its Wqkv laid out in four blocks of ``order``."""
    assert source.count(QKV_FORWARD) == 1
    return source.replace(QKV_FORWARD, MP_BLOCKS.format(order=order))
