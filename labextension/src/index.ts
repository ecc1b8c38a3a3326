/**
 * Registers the jupyter-gpufrac frontend: the status bar item for the current
 * kernel's GPU lease, the details panel, and notifications when the GPU agent
 * moved, shrank or killed a kernel.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { Session } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';

import { GpuFracModel } from './model';
import { InterventionNotifier } from './notify';
import { GpuFracPanel } from './panel';
import { GpuStatusItem } from './statusItem';
import { CurrentKernelTracker } from './tracker';

const PLUGIN_ID = 'jupyter-gpufrac:plugin';

export namespace CommandIDs {
  export const openPanel = 'gpufrac:open-panel';
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'GPU lease status, details and notifications for notebook kernels.',
  autoStart: true,
  optional: [IStatusBar, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null
  ) => {
    const services = app.serviceManager;
    const model = new GpuFracModel({
      serverSettings: services.serverSettings,
      events: services.events
    });
    // app.shell is the ILabShell in JupyterLab; its currentChanged drives it.
    const tracker = new CurrentKernelTracker(
      app.shell,
      model,
      widget => widget instanceof GpuFracPanel
    );

    // Running sessions name the notebooks behind kernel ids (other kernels'
    // notifications and the node's lease list).
    let sessions: Session.IModel[] = [];
    const updateSessions = () => {
      sessions = Array.from(services.sessions.running());
    };
    services.sessions.runningChanged.connect(updateSessions);
    updateSessions();
    const kernelName = (kernelId: string): string | null =>
      sessions.find(s => s.kernel?.id === kernelId)?.path ?? null;

    let panel: GpuFracPanel | null = null;
    const openPanel = (kernelId?: string) => {
      if (kernelId && kernelId !== model.kernelId) {
        // A notification about another notebook's kernel: show that one.
        model.kernelId = kernelId;
        model.path = kernelName(kernelId) ?? '';
      }
      if (!panel || panel.isDisposed) {
        panel = new GpuFracPanel(model, kernelName);
        app.shell.add(panel, 'main', { mode: 'split-right' });
      }
      app.shell.activateById(panel.id);
    };

    app.commands.addCommand(CommandIDs.openPanel, {
      label: 'Show GPU Lease Details',
      caption: 'The GPU lease of the current kernel and the GPUs of this node',
      execute: args => openPanel(args.kernelId as string | undefined)
    });
    palette?.addItem({ command: CommandIDs.openPanel, category: 'GPU' });

    // Notifications name the notebook: the event's, else the followed
    // notebook's when it is that kernel, else the session's.
    const notebookOf = (kernelId: string): string | null =>
      (kernelId === model.kernelId && model.path) || kernelName(kernelId);
    const notifier = new InterventionNotifier(notebookOf, id => openPanel(id));
    model.eventReceived.connect((_, event) => notifier.handle(event));

    if (statusBar) {
      const item = new GpuStatusItem(model, () => openPanel());
      statusBar.registerStatusItem(PLUGIN_ID, {
        item,
        align: 'left',
        rank: 100,
        isActive: () => tracker.hasKernelPanel,
        activeStateChanged: tracker.activeChanged
      });
    }
  }
};

export default plugin;
