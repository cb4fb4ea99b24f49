import csv,sys,collections
def ti(x):
    try: return int(float(x))
    except: return 0
rows=list(csv.reader(open(sys.argv[1])))
func=None;path=None;hdr=None
data=collections.defaultdict(list)
for r in rows:
    if not r: continue
    if r[0]=='File Path': path=r[1]; continue
    if r[0]=='Function Name': func=r[1]; continue
    if r[0]=='Line No': hdr=r; continue
    if hdr is None: continue
    d=dict(zip(hdr[:2]+['Address','SASS']+hdr[4:],r))
    data[func].append((path,d))
want=sys.argv[2]
print('columns:',hdr)
IE=[k for k in (hdr or []) if k.startswith('Instructions Executed')]
ie=IE[0] if IE else None
for f,items in data.items():
    if want not in f: continue
    print('==',f[:140])
    S="Warp Stall Sampling (All Samples)"
    src=[(ti(d.get(S)),ti(d.get(ie)) if ie else 0,p.split('/')[-1],d['Line No'],d['Source'][:100]) for p,d in items if d['Line No']]
    print('total samples',sum(s[0] for s in src),'total warp instr',sum(s[1] for s in src))
    print('-- by samples'); 
    for s in sorted(src,reverse=True)[:30]: print(s)
    print('-- by instructions')
    for s in sorted(src,key=lambda s:-s[1])[:30]: print(s)
    reasons=[k for k in hdr if k.startswith('stall_') and 'Not Issued' not in k]
    agg=collections.Counter()
    for p,d in items:
        if d['Line No']: continue
        for k in reasons: agg[k]+=ti(d.get(k))
    print(agg.most_common(10))
