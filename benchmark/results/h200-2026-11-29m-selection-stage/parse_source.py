import csv,sys,collections
def ti(x):
    try: return int(x)
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
for f,items in data.items():
    if want not in f: continue
    print('==',f[:120])
    tot=sum(ti(d.get("Warp Stall Sampling (All Samples)")) for p,d in items if d['Line No'])
    print('total samples (source lines)',tot)
    src=[(ti(d.get("Warp Stall Sampling (All Samples)")),p.split('/')[-1],d['Line No'],d['Source'][:90]) for p,d in items if d['Line No']]
    src.sort(reverse=True)
    for s in src[:25]: print(s)
    # stall reasons top over sass
    reasons=[k for k in hdr if k.startswith('stall_') and 'Not Issued' not in k]
    agg=collections.Counter()
    for p,d in items:
        if d['Line No']: continue
        for k in reasons:
            try: agg[k]+=ti(d.get(k))
            except: pass
    print(agg.most_common(8))
    sass=[(ti(d.get("Warp Stall Sampling (All Samples)")),d['SASS'].strip()[:70], max(reasons,key=lambda k:ti(d.get(k)) if (d.get(k) or '0').isdigit() else 0)) for p,d in items if not d['Line No']]
    sass.sort(reverse=True)
    for s in sass[:25]: print(s)
