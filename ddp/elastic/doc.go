// Package elastic runs a data-parallel job whose nodes may leave and join while it trains,
// without stopping the survivors, and with the same bits at every world size.
//
// Start the nodes with an elastic ddprun, the same command on each (the token shared):
//
//	GODDP_TOKEN=$(cat job.token) ddprun --nnodes 2:3 --nproc_per_node 1 \
//		--rdzv_endpoint node0:29500 ./trainer -- --global_batch_size 48 --micro_batch_size 8
//
// The trainer fixes the global batch, not the per-rank batch: a step is Shards logical
// shards (ddp.Options.Shards), whose gradients are summed in shard order whatever the world
// size, and whose data and random numbers are keyed by shard and step. It registers its
// state once, then trains inside Run:
//
//	job, err := elastic.Start(ctx, elastic.Options{Shards: L})
//	if err != nil { ... }
//	defer job.Close()
//	st := job.State()
//	st.Float32("w1", w1, 256, 1024) // parameters and optimizer state
//	st.Int64("data.next_sample", &next)
//	st.Config("--seed", seed)        // a process with another value is refused
//	err = job.Run(ctx, func(ctx context.Context, pg procgroup.ProcessGroup, start int64) error {
//		d, err := ddp.New(ctx, pg, params, ddp.Options{Shards: L})
//		if err != nil {
//			return err
//		}
//		defer d.Close()
//		for step := start; step < steps; step++ {
//			if err := d.BackwardShards(ctx, runShard); err != nil {
//				return err // a lost peer: Run forms the next epoch
//			}
//			sgd(params)
//			next += globalBatch
//			if err := job.Commit(ctx, step+1); err != nil {
//				return err // nodes wait to join: the same on every rank
//			}
//		}
//		return pg.Barrier(ctx).Wait(ctx)
//	})
//
// Each epoch has its own process group. When a process dies, its peers' collectives fail
// and they open the next rendezvous round; when a host goes silent, the heartbeats find
// it (Note [Elastic heartbeats]); when nodes wait to join, Commit's check ends the epoch
// at a step boundary. The survivors and the waiting nodes form the next epoch (Note
// [Elastic rounds]), the state of the last step every survivor committed is broadcast
// from one of them (Note [Elastic state]), and Run calls body again from that step. Each
// member says the change in one line (Note [Elastic reports]).
//
// A state that each rank holds its own of, such as PowerSGD's error feedback, is
// registered with State.PerRank and given its object in each epoch with Job.Attach (Note
// [Elastic per-rank state]).
//
// Outside an elastic launcher, Start makes a fixed group (ddp.InitProcessGroup), Run calls
// body once from step 0, and Commit does nothing: one trainer serves both.
//
// The store is hosted by the ddprun that owns --rdzv_endpoint. If that host is lost, the
// job is lost: every rank's heartbeat finds the store silent after the heartbeat timeout,
// and every rank fails with an error that names it (the store is not replicated).
package elastic
