import json, struct, sys, collections
path = sys.argv[1]
meta = json.load(open(path + '.json'))
b = open(path, 'rb').read()
assert b[:8] == b'SPINTRC1'
page_size, _, nrec, npages = struct.unpack_from('<IIQQ', b, 8)
off = 8 + 24
recs = []
for i in range(nrec):
    step, req, layer, head, cnt = struct.unpack_from('<QIIII', b, off); off += 24
    recs.append((step, req, layer, head, cnt))
pages = struct.unpack_from('<%dI' % npages, b, off)
by_req = collections.defaultdict(list)
at = 0
for step, req, layer, head, cnt in recs:
    by_req[req].append((layer, head, frozenset(pages[at:at + cnt])))
    at += cnt
info = {m['request']: m for m in meta}
base = {(m['prompt'], m['budget']): m['request'] for m in meta if m['algorithm'] == 'quest'}
for m in meta:
    if m['algorithm'] == 'quest':
        continue
    a = by_req[base[(m['prompt'], m['budget'])]]
    v = by_req[m['request']]
    assert len(a) == len(v), (len(a), len(v))
    same = tot = identical = 0
    for (la, ha, sa), (lv, hv, sv) in zip(a, v):
        assert (la, ha) == (lv, hv)
        same += len(sa & sv); tot += len(sa); identical += sa == sv
    print(f"{m['prompt']:12} {m['budget']:5} {m['algorithm']:14} pages shared with exact {same / tot:.4f}, "
          f"identical selections {identical / len(a):.4f} of {len(a)}")
